// Renders the operator's page in headless Chromium; prints one JSON line of what it shows.
// Usage: node status.mjs '{"url": ..., "chromium": ..., "screenshot": ..., "nodes": 2}'
import { chromium } from "playwright-core";

const config = JSON.parse(process.argv[2]);
const browser = await chromium.launch({
  executablePath: config.chromium,
  args: ["--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const requests = [];
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 820 } });
  page.on("request", (request) => requests.push(request.url()));
  await page.goto(config.url);
  // Live: the page has polled at least twice and lists every node.
  const first = await page.waitForFunction(() => window.lastStatus, null, { timeout: 15000 });
  const firstAt = await first.jsonValue();
  await page.waitForFunction(
    ([since, nodes]) => window.lastStatus > since
      && document.querySelectorAll("#nodes tr[data-node]").length === nodes,
    [firstAt, config.nodes], { timeout: 15000 });
  const fields = await page.evaluate(() => Object.fromEntries(
    [...document.querySelectorAll("[data-field]")].map((el) => [el.dataset.field, el.textContent])));
  const nodes = await page.evaluate(() => [...document.querySelectorAll("#nodes tr[data-node]")]
    .map((row) => [...row.children].map((cell) => cell.textContent)));
  const chartInk = await page.evaluate(() => {
    const canvas = document.getElementById("chart");
    const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let coloured = 0;
    for (let i = 0; i < data.length; i += 4) if (data[i + 3] > 0 && data[i] !== data[i + 2]) coloured++;
    return coloured;
  });
  await page.screenshot({ path: config.screenshot, fullPage: true });
  const foreign = requests.filter((url) => !url.startsWith(new URL(config.url).origin));
  console.log(JSON.stringify({ ok: true, fields, nodes, chartInk, foreign }));
} catch (err) {
  console.log(JSON.stringify({ ok: false, error: String(err) }));
  process.exitCode = 1;
} finally {
  await browser.close();
}
