// Drives headless Chromium against a running node; prints one JSON line of results.
// Usage: node run.mjs '{"ws": ..., "http": ..., "secret": ..., "tokens": {...}}'
import { chromium } from "playwright-core";
import { fileURLToPath } from "node:url";

const config = JSON.parse(process.argv[2]);
const page_url = new URL("client.html", import.meta.url).href;
const steps = [];

function check(condition, what) {
  if (!condition) throw new Error(`failed: ${what}`);
  steps.push(what);
}

async function open(browser, user, games) {
  const page = await browser.newPage();
  const params = { url: config.ws, token: config.tokens[user], games };
  await page.goto(`${page_url}#${encodeURIComponent(JSON.stringify(params))}`);
  return page;
}

const state = (page) => page.evaluate(() => window.state);

async function until(page, predicate, what, timeout = 5000) {
  const deadline = Date.now() + timeout;
  for (;;) {
    const current = await state(page);
    if (predicate(current)) { steps.push(what); return current; }
    if (Date.now() > deadline) throw new Error(`timed out: ${what}: ${JSON.stringify(current)}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

async function publish(body) {
  const response = await fetch(`${config.http}/publish`, {
    method: "POST",
    headers: { Authorization: `Bearer ${config.secret}`, "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  check(response.status === 202, `publish ${body.verb} accepted`);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const online = (s, user) => s.presence !== null && s.presence.visible.includes(user);

const browser = await chromium.launch({
  executablePath: config.chromium,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const alice = await open(browser, "alice", [["chess", "g1"]]);
  const bob = await open(browser, "bob", [["go", "g2"]]);
  await until(alice, (s) => online(s, "alice") && online(s, "bob"), "alice sees both online");
  await until(bob, (s) => online(s, "alice") && online(s, "bob"), "bob sees both online");

  await publish({ verb: "game", payload: { meta: "chess", id: "g1" } });
  await until(alice, (s) => s.events.some((e) => e.verb === "game"), "alice gets her game's move");
  await sleep(300);
  check((await state(bob)).events.length === 0, "bob does not get another game's move");

  await publish({ verb: "chat", payload: { meta: "chess", id: "g1" }, exclude: ["alice"] });
  await sleep(300);
  check((await state(alice)).events.length === 1, "the acting user is excluded");

  const aliceTab2 = await open(browser, "alice", [["chess", "g1"]]);
  await until(aliceTab2, (s) => s.snapshots === 1 && online(s, "alice"), "alice's second tab");
  await aliceTab2.close();
  await sleep(800);
  check(online(await state(bob), "alice"), "closing one of two tabs is not a leave");

  await alice.close();
  await until(bob, (s) => !online(s, "alice"), "closing the last tab is a leave");

  await publish({ verb: "test", payload: "hello from the admin" });
  await until(bob, (s) => s.events.some((e) => e.verb === "test"), "bob gets the admin toast");

  const final = await state(bob);
  check(final.gaps === 0 && final.errors.length === 0 && final.closed === null,
    "no gaps, no errors, still open");
  console.log(JSON.stringify({ ok: true, steps, presence: final.presence }));
} catch (error) {
  console.log(JSON.stringify({ ok: false, steps, error: String(error) }));
  process.exitCode = 1;
} finally {
  await browser.close();
}
