-- A quick load check (not the benchmark harness): every request acquires a fresh
-- lock for 10 minutes, so each one is a durable grant.
--   cargo build --release
--   ./target/release/fencelock serve --data-dir /tmp/fl-bench &
--   wrk -t1 -c64 -d10s --latency -s scripts/wrk-acquire.lua http://127.0.0.1:7420
math.randomseed(os.time() + math.floor(os.clock() * 1000000))
counter = 0
request = function()
  counter = counter + 1
  local body = string.format('{"name":"bench:%d:%d","ttl_ms":600000}', math.random(1, 1000000000), counter)
  return wrk.format("POST", "/v1/acquire", {["Content-Type"] = "application/json"}, body)
end
