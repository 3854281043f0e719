# SPDX-License-Identifier: Apache-2.0
"""Stand-in package (tests/plugin): not vLLM."""
