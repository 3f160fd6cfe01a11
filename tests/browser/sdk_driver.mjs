// Headless Chromium driven over stdin/stdout, one JSON line per command and per answer,
// for tests/test_browser_sdk_nodes.py. The pages come from a small HTTP server on
// 127.0.0.1 (sdk.html from here, realtime.js from clients/js/dist): a loopback origin,
// like the nodes, so Chromium's local network access checks let the page reach them.
//   {"id", "op": "open", "page", "config"}   a page in a fresh context (its own sessionStorage)
//   {"id", "op": "eval", "page", "expr"}     the expression's value in the page
//   {"id", "op": "wait", "page", "expr", "timeout"}  until the expression is truthy
import { chromium } from "playwright-core";
import { readFile } from "node:fs/promises";
import { createServer } from "node:http";
import { createInterface } from "node:readline";

const options = JSON.parse(process.argv[2]);
const here = new URL(".", import.meta.url);
const files = {
  "/sdk.html": [new URL("sdk.html", here), "text/html"],
  "/realtime.js": [new URL("../../clients/js/dist/realtime.js", here), "text/javascript"],
  "/realtime.js.map": [new URL("../../clients/js/dist/realtime.js.map", here), "application/json"],
};

const server = createServer(async (request, response) => {
  const file = files[new URL(request.url, "http://x").pathname];
  if (!file) return response.writeHead(404).end();
  response.writeHead(200, { "Content-Type": file[1], "Cache-Control": "no-store" });
  response.end(await readFile(file[0]));
});
await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
const origin = `http://127.0.0.1:${server.address().port}`;

const browser = await chromium.launch({
  executablePath: options.chromium,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const pages = new Map();
const consoles = new Map();

async function open(name, config) {
  const context = await browser.newContext();
  const page = await context.newPage();
  const lines = [];
  consoles.set(name, lines);
  page.on("console", (message) => lines.push(`${message.type()}: ${message.text()}`));
  page.on("pageerror", (error) => lines.push(`pageerror: ${error}`));
  pages.set(name, page);
  await page.goto(`${origin}/sdk.html#${encodeURIComponent(JSON.stringify(config))}`);
  await page.waitForFunction(() => window.rt !== undefined, null, { timeout: 10_000 });
}

async function handle(command) {
  const page = pages.get(command.page);
  switch (command.op) {
    case "open":
      await open(command.page, command.config);
      return null;
    case "eval":
      return await page.evaluate(command.expr);
    case "wait":
      await page.waitForFunction(command.expr, null, { timeout: command.timeout, polling: 50 });
      return null;
    default:
      throw new Error(`unknown op ${command.op}`);
  }
}

const input = createInterface({ input: process.stdin });
for await (const line of input) {
  const command = JSON.parse(line);
  let answer;
  try {
    answer = { id: command.id, ok: true, value: (await handle(command)) ?? null };
  } catch (error) {
    const page = pages.get(command.page);
    const rt = page ? await page.evaluate(() => JSON.stringify(window.rt ?? null)).catch(() => null) : null;
    answer = { id: command.id, ok: false, error: String(error), rt, console: consoles.get(command.page) ?? [] };
  }
  process.stdout.write(JSON.stringify(answer) + "\n");
}
await browser.close();
server.close();
