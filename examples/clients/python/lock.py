"""Take a lock, renew it, pass its fence to a resource and release it, over
fencelock's HTTP/JSON API with `requests`.

    FENCELOCK_URL=http://127.0.0.1:7420 python3 lock.py [LOCK_NAME]

Set FENCELOCK_TOKEN when the server has tokens configured. The script exits
non-zero if anything differs from what the API promises (it runs in the
project's tests against the real server).
"""

import os
import sys

import requests


class FencelockError(Exception):
    """An error answer: `code` is stable, branch on it; `message` is for people."""

    def __init__(self, status, code, message):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class Fencelock:
    """A few lines over `requests`: one session, JSON in and out, errors raised."""

    def __init__(self, url, token=None):
        self.url = url.rstrip("/")
        self.http = requests.Session()
        if token:
            self.http.headers["Authorization"] = f"Bearer {token}"

    def post(self, path, body, timeout=30):
        # `json=` sends Content-Type: application/json, which the server requires
        # of every body when authentication is off.
        answer = self.http.post(self.url + path, json=body, timeout=timeout)
        if not answer.ok:
            error = answer.json()["error"]
            raise FencelockError(answer.status_code, error["code"], error["message"])
        return answer.json()

    def acquire(self, name, ttl_ms, wait_ms=0, owner=""):
        # The HTTP timeout must outlast the server-side wait.
        body = {"name": name, "ttl_ms": ttl_ms, "wait_ms": wait_ms, "owner": owner}
        return self.post("/v1/acquire", body, timeout=30 + wait_ms / 1000)

    def renew(self, grant, ttl_ms=None):
        body = {"name": grant["name"], "owner_token": grant["owner_token"]}
        if ttl_ms is not None:
            body["ttl_ms"] = ttl_ms
        return self.post("/v1/renew", body)

    def release(self, grant):
        body = {"name": grant["name"], "owner_token": grant["owner_token"]}
        return self.post("/v1/release", body)


class StaleFence(Exception):
    """The resource refused a write whose fence is not newer than the last one."""


class Resource:
    """What the protected resource does with the fence (here in memory; in a
    database, one conditional UPDATE): accept a write only if its fence is larger
    than the last one accepted, atomically with the write."""

    def __init__(self):
        self.last_fence = 0
        self.value = None

    def write(self, fence, value):
        if fence <= self.last_fence:
            raise StaleFence(f"fence {fence} is not newer than {self.last_fence}")
        self.last_fence = fence
        self.value = value


def main():
    url = os.environ.get("FENCELOCK_URL", "http://127.0.0.1:7420")
    name = sys.argv[1] if len(sys.argv) > 1 else "example:python"
    lock = Fencelock(url, os.environ.get("FENCELOCK_TOKEN"))
    resource = Resource()

    first = lock.acquire(name, ttl_ms=10_000, owner="python-example")
    print(f"acquired {name} with fence {first['fence']}")

    renewed = lock.renew(first, ttl_ms=20_000)
    assert renewed["fence"] == first["fence"], "a renewal keeps the fence"
    print(f"renewed for {renewed['ttl_ms']} ms")

    # Pass the fence with every write.
    resource.write(first["fence"], "written by the first holder")

    # While it is held, another acquire is refused at once (or waits, with wait_ms).
    try:
        lock.acquire(name, ttl_ms=10_000)
        sys.exit("a held lock was granted twice")
    except FencelockError as e:
        assert (e.status, e.code) == (409, "held"), e
        print(f"a second holder is refused: {e.code}")

    released = lock.release(first)
    assert released == {"released": True}, released
    print("released")

    # The next holder gets a larger fence, and the resource follows it...
    second = lock.acquire(name, ttl_ms=10_000, owner="python-example-2")
    assert second["fence"] > first["fence"], "fences only grow"
    resource.write(second["fence"], "written by the second holder")

    # ...so a late write by the first holder (paused past its lease, say) is refused.
    try:
        resource.write(first["fence"], "a late write")
        sys.exit("the resource accepted a stale fence")
    except StaleFence as e:
        print(f"the resource refused a write with fence {first['fence']}: {e}")

    lock.release(second)

    # A mistake gets a stable code: the body lacks the required `name`.
    try:
        lock.post("/v1/acquire", {"ttl_ms": 1000})
        sys.exit("a body without a name was accepted")
    except FencelockError as e:
        assert (e.status, e.code) == (400, "invalid_argument"), e
    print("ok")


if __name__ == "__main__":
    main()
