// A page on another origin tries to act on a fencelock server with authentication
// off (issue 19 item 6), in headless Chromium. Started by tests/e2e_cross_origin.rs,
// which starts the server, holds a lock, serves the attacker's page from a second
// origin and afterwards checks the lock state through the API:
//   ATTACKER_URL   the attacker's page (another origin than the server)
//   CHROMIUM       the browser (default /usr/bin/chromium)
// The page (written by the Rust test) runs every attack and sets `window.attackDone`
// to a summary; this script prints it as one line `RESULT {json}` and exits 0.
// Whether the attacks worked is judged by the Rust test from the server's state.
import { chromium } from "playwright-core";

const attacker = process.env.ATTACKER_URL;
if (!attacker) throw new Error("missing environment variable ATTACKER_URL");
// Upper bound for each wait, so a broken page fails instead of hanging.
const WAIT_MS = 15000;

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
  ],
});
try {
  const page = await browser.newPage();
  page.on("console", (m) => console.log(`page: ${m.text()}`));
  await page.goto(attacker, { timeout: WAIT_MS });
  const result = await page.waitForFunction(() => window.attackDone, null, {
    timeout: WAIT_MS,
  });
  console.log(`RESULT ${JSON.stringify(await result.jsonValue())}`);
} finally {
  await browser.close();
}
