//! Random command sequences into the core: arbitrary bytes become a small config
//! and a sequence of `(dt_ms, Command)` steps over a small universe of names,
//! tokens and sessions, so commands collide. After every step the core's
//! `check_invariants()` must hold, fences must only grow, every command must
//! round-trip through the log codec, and a snapshot taken at any step must import
//! to the same state. At the end, replaying the same log on a fresh core must give
//! the same state (what recovery relies on).

use fencelock_core::{
    Acquire, Command, Config, Core, Fence, LockName, Outcome, Owner, OwnerToken, Reason, Reply,
    RequestId, SessionId,
};
use fencelock_server::codec::{
    decode_record, decode_snapshot, encode_record, encode_snapshot, RecordMeta,
};

use crate::{plant, Input, MAX_INPUT_BYTES};

/// Most steps one input drives.
pub const MAX_STEPS: usize = 2_000;

const NAMES: [&str; 4] = ["a", "b", "c", "a:b"];
const TOKENS: u128 = 8;
const SESSIONS: u128 = 3;

/// Runs the sequence `data` describes; panics if the core breaks an invariant.
pub fn core_commands(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    let mut input = Input::new(data);
    let config = config(&mut input);
    let mut core = Core::new(config.clone());
    let mut log: Vec<(u64, Command)> = Vec::new();
    let mut now_ms = 0u64;
    let mut max_fence = 0u64;
    let mut seen_fences = std::collections::BTreeSet::new();
    let mut snapshots = 0;
    for step in 0..MAX_STEPS {
        if input.is_empty() {
            break;
        }
        now_ms += dt_ms(&mut input);
        let op = input.byte();
        if op == 0xff {
            // Snapshot and restore, as a restart does (without `Recover`).
            let image = core.export();
            let bytes = encode_snapshot(&image);
            let decoded = decode_snapshot(&bytes).expect("a snapshot we encoded decodes");
            assert_eq!(decoded, image, "snapshot codec round trip at step {step}");
            core = Core::import(config.clone(), decoded).unwrap_or_else(|e| {
                panic!("the core refused its own snapshot at step {step}: {e}")
            });
            assert_eq!(core.export(), image, "import/export differ at step {step}");
            snapshots += 1;
            continue;
        }
        let command = command(op, &mut input);
        let meta = RecordMeta {
            seq: step as u64 + 1,
            now_ms,
            wall_ms: 0,
            actor: None,
        };
        let record = encode_record(&meta, &command);
        assert_eq!(
            decode_record(&record).expect("a record we encoded decodes"),
            (meta, command.clone()),
            "record codec round trip at step {step}"
        );
        log.push((now_ms, command.clone()));
        let reply = core.apply(now_ms, command);
        let mut granted: Vec<(Fence, OwnerToken)> = Vec::new();
        if let Ok(Reply::Granted(g)) = &reply {
            granted.push((g.fence, g.token));
        }
        for outcome in core.take_outcomes() {
            if let Outcome::Granted(g) = outcome {
                granted.push((g.fence, g.token));
            }
        }
        // Deadlines due at `now_ms` may hand locks off before the command itself
        // grants, so within one step fences come in any order; each new one must be
        // above every fence of earlier steps. An idempotent retry gets its old one —
        // even in the step that hands it to its waiter: the hand-off and the retry's
        // reply then report the same grant (same fence, same token) twice. Two
        // grants may never share a fence.
        let before = max_fence;
        let mut this_step = std::collections::BTreeMap::new();
        for (fence, token) in granted {
            let f = fence.get();
            let first = *this_step.entry(f).or_insert(token);
            assert!(first == token, "fence {f} granted twice at step {step}");
            assert!(
                f > before || seen_fences.contains(&f),
                "fence {f} at step {step} is not above {before} and was never granted"
            );
            max_fence = max_fence.max(f);
            seen_fences.insert(f);
        }
        if let Err(broken) = core.check_invariants() {
            panic!("invariant broken at step {step}: {broken}");
        }
        if core.stats().holders >= 3 && snapshots > 0 && core.stats().sessions > 0 {
            plant(
                "core_commands",
                "three holders and a session after a snapshot",
            );
        }
    }
    // Replay determinism: the same log on a fresh core gives the same state.
    let mut replayed = Core::new(config);
    for (now_ms, command) in log {
        let _ = replayed.apply(now_ms, command);
        replayed.take_outcomes();
    }
    assert_eq!(
        replayed.export(),
        core.export(),
        "replaying the log gives another state"
    );
}

/// Bounds small enough that sequences run into every one of them.
fn config(input: &mut Input<'_>) -> Config {
    let b = input.byte() as usize;
    Config {
        min_ttl_ms: 5,
        max_ttl_ms: 60,
        max_wait_ms: 50,
        max_lock_delay_ms: 25,
        max_limit: 3,
        max_locks: 1 + b % 4,
        max_waiters_per_lock: 1 + (b >> 2) % 4,
        max_waiters: 2 + (b >> 4) % 6,
        max_sessions: 1 + (b >> 6) % 3,
        max_locks_per_session: 1 + input.below(3),
        max_recent_ends: input.below(8),
    }
}

fn dt_ms(input: &mut Input<'_>) -> u64 {
    match input.byte() {
        0..=199 => 0,
        b @ 200..=254 => u64::from(b - 199),
        255 => u64::from(input.u16()),
    }
}

fn name(input: &mut Input<'_>) -> LockName {
    LockName::new(NAMES[input.below(NAMES.len())]).expect("valid name")
}

fn token(input: &mut Input<'_>) -> OwnerToken {
    OwnerToken::from_u128(1 + input.below(TOKENS as usize) as u128)
}

fn session(input: &mut Input<'_>) -> SessionId {
    SessionId::from_u128(1 + input.below(SESSIONS as usize) as u128)
}

/// A small number, sometimes out of range, sometimes extreme.
fn ms(input: &mut Input<'_>) -> u64 {
    match input.byte() {
        0 => 0,
        1 => u64::MAX,
        2 => u64::from(input.u32()),
        b => u64::from(b % 80),
    }
}

pub(crate) fn command(op: u8, input: &mut Input<'_>) -> Command {
    match op % 16 {
        0..=4 => {
            let flags = input.byte();
            let session = (flags & 1 != 0).then(|| session(input));
            let ttl_ms = if session.is_some() && flags & 2 == 0 {
                None
            } else {
                Some(ms(input))
            };
            Command::Acquire(Acquire {
                name: name(input),
                token: token(input),
                ttl_ms,
                wait_ms: if flags & 4 != 0 { ms(input) } else { 0 },
                owner: Owner::new(&format!("o{}", flags >> 5)).expect("valid owner"),
                request_id: (flags & 8 != 0)
                    .then(|| RequestId::new(&format!("r{}", input.below(3))).expect("valid id")),
                limit: match input.byte() % 8 {
                    0 => 0,
                    7 => u32::MAX,
                    l => u32::from(l % 4),
                },
                lock_delay_ms: if flags & 16 != 0 { ms(input) } else { 0 },
                session,
                // No principal: the bytes each command consumes stay as they were,
                // so the kept regression inputs replay unchanged.
                tenant: None,
                quota: None,
                // Exclusive, no value: as above, the kept inputs replay unchanged.
                mode: fencelock_core::Mode::Exclusive,
                value: None,
            })
        }
        5 | 6 => Command::Renew {
            name: name(input),
            token: token(input),
            ttl_ms: (input.byte() & 1 != 0).then(|| ms(input)),
        },
        7 | 8 => Command::Release {
            name: name(input),
            token: token(input),
        },
        9 => Command::ForceRelease {
            name: name(input),
            fence: Fence::new(u64::from(input.byte() % 8)),
            reason: Reason::new("fuzz").expect("valid reason"),
        },
        10 => Command::CancelWait {
            name: name(input),
            token: token(input),
        },
        11 => Command::OpenSession {
            id: session(input),
            ttl_ms: ms(input),
            owner: Owner::new("s").expect("valid owner"),
            tenant: None,
            quota: None,
        },
        12 => Command::KeepAlive { id: session(input) },
        13 => Command::CloseSession { id: session(input) },
        14 => match input.byte() % 8 {
            0 => Command::Recover,
            1 => Command::RaiseFenceFloor {
                floor: match input.byte() % 4 {
                    0 => u64::MAX,
                    1 => 1 << 63,
                    _ => u64::from(input.byte()),
                },
            },
            _ => Command::Tick,
        },
        _ => Command::Tick,
    }
}
