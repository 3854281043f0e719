// SPDX-License-Identifier: Apache-2.0
// Drives pdproxy with the official OpenAI SDK for Node: a non-streamed
// completion and a streamed chat completion. Prints {"completion","chat"}.
// Usage: node openai_client.mjs <sdk-dir> <base-url> <model>
import { createRequire } from "node:module";
import path from "node:path";

const [sdkDir, baseURL, model] = process.argv.slice(2);
const require = createRequire(path.join(sdkDir, "package.json"));
const OpenAI = require("openai").default ?? require("openai");

const client = new OpenAI({ baseURL, apiKey: "sk-test", maxRetries: 0, timeout: 30000 });

const completion = await client.completions.create({
  model,
  prompt: "The official SDK asks for a completion through the proxy",
  max_tokens: 12,
});

const stream = await client.chat.completions.create({
  model,
  messages: [{ role: "user", content: "Stream me a chat answer through pdproxy, please." }],
  max_tokens: 10,
  stream: true,
  stream_options: { include_usage: true },
});
let chat = "";
let usage = null;
for await (const chunk of stream) {
  for (const c of chunk.choices) chat += c.delta?.content ?? "";
  if (chunk.usage) usage = chunk.usage;
}
console.log(JSON.stringify({ completion: completion.choices[0].text, chat, usage }));
