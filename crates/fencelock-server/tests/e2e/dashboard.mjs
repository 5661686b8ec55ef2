// Drives headless Chromium against a running fencelock server's dashboard.
// Started by tests/e2e_dashboard.rs, which starts the server, acquires the locks and
// passes their details in the environment:
//   FENCELOCK_URL          base URL of the server
//   E2E_LOCK, E2E_FENCE, E2E_TOKEN   a held lock (released by this script, over HTTP)
//   E2E_STUCK              a held lock to force-release through the dashboard
//   E2E_EVIL               a held lock whose name contains markup
//   E2E_SHOTS              directory for screenshots
//   CHROMIUM               the browser (default /usr/bin/chromium)
// Exits 0 and prints "E2E OK" if every check passed; any failure throws (exit 1).
import { chromium } from "playwright-core";
import fs from "node:fs";
import path from "node:path";

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`missing environment variable ${name}`);
  return v;
};
const base = env("FENCELOCK_URL");
const lock = env("E2E_LOCK");
const fence = env("E2E_FENCE");
const token = env("E2E_TOKEN");
const stuck = env("E2E_STUCK");
const evil = env("E2E_EVIL");
const shots = env("E2E_SHOTS");
// Upper bound for each wait, so a broken page fails instead of hanging.
const WAIT_MS = 15000;

fs.mkdirSync(shots, { recursive: true });
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
  // Playwright starts the browser with a new, empty profile directory of its own.
});
const check = (ok, what) => {
  if (!ok) throw new Error(`check failed: ${what}`);
  console.log(`ok: ${what}`);
};
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  const dialogs = [];
  page.on("dialog", async (d) => {
    dialogs.push({ type: d.type(), message: d.message() });
    // The force-release confirmation is accepted; anything else (an alert from
    // injected script) is recorded and fails the test below.
    if (d.type() === "confirm") await d.accept();
    else await d.dismiss();
  });
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(String(e)));

  await page.goto(`${base}/`, { waitUntil: "domcontentloaded" });
  const row = page.locator(`tr[data-lock="${lock}"]`);
  await row.waitFor({ timeout: WAIT_MS });
  check((await row.locator("td.fence").innerText()).trim() === fence, `lock ${lock} shows fence ${fence}`);
  // The lock with markup in its name is shown as text, not run.
  const evilLink = page.locator("a.lock", { hasText: evil });
  await evilLink.first().waitFor({ timeout: WAIT_MS });
  check((await evilLink.first().innerText()) === evil, "a name with <script> is shown as text");
  // Wait until the live stream has replaced the table once (htmx is working).
  await page.waitForFunction(() => window.htmx !== undefined, null, { timeout: WAIT_MS });
  await page.evaluate(() => {
    window.__fencelockNoReload = true;
  });
  await page.screenshot({ path: path.join(shots, "dashboard.png"), fullPage: true });

  // Release over the API; the page must drop the row without a reload.
  const res = await fetch(`${base}/v1/release`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ name: lock, owner_token: token }),
  });
  check(res.status === 200, `release answered ${res.status}`);
  await row.waitFor({ state: "detached", timeout: WAIT_MS });
  const released = page.locator("#events tr", { hasText: "release" }).filter({ hasText: lock });
  await released.first().waitFor({ timeout: WAIT_MS });
  check(
    await page.evaluate(() => window.__fencelockNoReload === true),
    "the row went away and a release event appeared without a page reload",
  );
  await page.screenshot({ path: path.join(shots, "dashboard-after-release.png"), fullPage: true });

  // Force release through the dashboard, with a reason and a confirmation.
  await page.goto(`${base}/ui/lock/${encodeURIComponent(stuck)}`, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.htmx !== undefined, null, { timeout: WAIT_MS });
  await page.fill('#force-release input[name="reason"]', "e2e: holder is stuck");
  await page.click('#force-release button[type="submit"]');
  const result = page.locator("#force-result .ok");
  await result.waitFor({ timeout: WAIT_MS });
  check((await result.innerText()).includes("Force-released"), "force release reports success");
  const audited = page.locator("#history tr", { hasText: "force released" });
  await audited.first().waitFor({ timeout: WAIT_MS });
  check(
    (await audited.first().innerText()).includes("reason: e2e: holder is stuck"),
    "the lock's history shows the forced release with its reason",
  );
  check(
    dialogs.some((d) => d.type === "confirm" && d.message.includes(stuck)),
    "force release asked for confirmation",
  );
  await page.screenshot({ path: path.join(shots, "force-release.png"), fullPage: true });

  check(!dialogs.some((d) => d.type !== "confirm"), `no script ran from user data (dialogs: ${JSON.stringify(dialogs)})`);
  check(pageErrors.length === 0, `no page errors (${pageErrors.join("; ")})`);
  console.log("E2E OK");
} finally {
  await browser.close();
}
