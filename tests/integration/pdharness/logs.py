# SPDX-License-Identifier: Apache-2.0
"""pdproxy's log lines: the strict logfmt parser the tests read them with."""

import re


class LogfmtError(AssertionError):
    pass


def parse_logfmt(line):
    """Strict logfmt as go-logfmt reads it: key=value pairs separated by
    blanks; keys without '=', '"' or blanks; bare values without '=', '"' or
    blanks; quoted values with \\" \\\\ \\n \\t \\r escapes. Duplicate keys
    are an error (a log reader would keep only one of them)."""
    out = {}
    i, n = 0, len(line)
    for _ in range(n + 1):
        while i < n and line[i] == " ":
            i += 1
        if i >= n:
            return out
        m = re.compile(r'[^\s="]+').match(line, i)
        if not m:
            raise LogfmtError("bad key at column %d of %r" % (i, line))
        key = m.group(0)
        i = m.end()
        if key in out:
            raise LogfmtError("duplicate key %r in %r" % (key, line))
        if i >= n or line[i] == " ":
            out[key] = True
            continue
        if line[i] != "=":
            raise LogfmtError("unexpected %r after key %r in %r" % (line[i], key, line))
        i += 1
        if i < n and line[i] == '"':
            i += 1
            val = []
            for _ in range(n + 1):
                if i >= n:
                    raise LogfmtError("unterminated quoted value in %r" % line)
                c = line[i]
                if c == "\\":  # go-logfmt unquotes as JSON strings
                    e = line[i + 1] if i + 1 < n else ""
                    if e == "u" and re.match(r"[0-9a-fA-F]{4}", line[i + 2:i + 6]):
                        val.append(chr(int(line[i + 2:i + 6], 16)))
                        i += 6
                        continue
                    if not e or e not in '"\\/bfnrt':
                        raise LogfmtError("bad escape in %r" % line)
                    val.append({'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                                "r": "\r", "t": "\t"}[e])
                    i += 2
                    continue
                if c == '"':
                    i += 1
                    break
                if ord(c) < 0x20:
                    raise LogfmtError("control character in %r" % line)
                val.append(c)
                i += 1
            if i < n and line[i] != " ":
                raise LogfmtError("blank expected after a quoted value in %r" % line)
            out[key] = "".join(val)
            continue
        m = re.compile(r'[^\s]*').match(line, i)
        val = m.group(0)
        if "=" in val or '"' in val:
            raise LogfmtError("unquoted value with '=' or '\"' (%r) in %r" % (val, line))
        out[key] = val
        i = m.end()
    raise LogfmtError("unparsable %r" % line)
