// Take a lock, renew it, pass its fence to a resource and release it, over
// fencelock's HTTP/JSON API with `fetch` (Node.js 18 or newer, or a browser page
// served by the same origin).
//
//     FENCELOCK_URL=http://127.0.0.1:7420 node lock.mjs [LOCK_NAME]
//
// Set FENCELOCK_TOKEN when the server has tokens configured. Exits non-zero if
// anything differs from what the API promises (it runs in the project's tests).

class FencelockError extends Error {
  constructor(status, code, message) {
    super(`${status} ${code}: ${message}`);
    this.status = status;
    this.code = code; // stable: branch on it, never on the message
  }
}

class Fencelock {
  constructor(url, token) {
    this.url = url.replace(/\/+$/, "");
    this.headers = { "Content-Type": "application/json" };
    if (token) this.headers.Authorization = `Bearer ${token}`;
  }

  async post(path, body) {
    const answer = await fetch(this.url + path, {
      method: "POST",
      headers: this.headers,
      body: JSON.stringify(body),
    });
    const json = await answer.json();
    if (!answer.ok) throw new FencelockError(answer.status, json.error.code, json.error.message);
    return json;
  }

  acquire(name, ttlMs, { waitMs = 0, owner = "" } = {}) {
    return this.post("/v1/acquire", { name, ttl_ms: ttlMs, wait_ms: waitMs, owner });
  }

  renew(grant, ttlMs) {
    return this.post("/v1/renew", { name: grant.name, owner_token: grant.owner_token, ttl_ms: ttlMs });
  }

  release(grant) {
    return this.post("/v1/release", { name: grant.name, owner_token: grant.owner_token });
  }
}

// The protected resource: accepts a write only if its fence is newer than the
// last one it accepted (in a database: one conditional UPDATE).
class Resource {
  lastFence = 0;
  write(fence, value) {
    if (fence <= this.lastFence) throw new Error(`stale fence ${fence} (last ${this.lastFence})`);
    this.lastFence = fence;
    this.value = value;
  }
}

function check(condition, what) {
  if (!condition) {
    console.error(`FAILED: ${what}`);
    process.exit(1);
  }
}

const lock = new Fencelock(process.env.FENCELOCK_URL ?? "http://127.0.0.1:7420", process.env.FENCELOCK_TOKEN);
const name = process.argv[2] ?? "example:js";
const resource = new Resource();

const first = await lock.acquire(name, 10_000, { owner: "js-example" });
console.log(`acquired ${name} with fence ${first.fence}`);
const renewed = await lock.renew(first, 20_000);
check(renewed.fence === first.fence, "a renewal keeps the fence");
console.log(`renewed for ${renewed.ttl_ms} ms`);
resource.write(first.fence, "written by the first holder");

try {
  await lock.acquire(name, 10_000);
  check(false, "a held lock was granted twice");
} catch (e) {
  check(e instanceof FencelockError && e.status === 409 && e.code === "held", `held: ${e}`);
  console.log(`a second holder is refused: ${e.code}`);
}

const released = await lock.release(first);
check(released.released === true, "released");
console.log("released");

const second = await lock.acquire(name, 10_000, { owner: "js-example-2" });
check(second.fence > first.fence, "fences only grow");
resource.write(second.fence, "written by the second holder");
try {
  resource.write(first.fence, "a late write");
  check(false, "the resource accepted a stale fence");
} catch (e) {
  console.log(`the resource refused a write with fence ${first.fence}: ${e.message}`);
}
await lock.release(second);
console.log("ok");
