//! Shared by the property tests (`model.rs`, `replay.rs`): a small universe of lock
//! names, sessions and tokens, a random command generator over it, and a compact
//! rendering of commands so a shrunk failure reads as a script.
#![allow(dead_code)] // each test binary uses its own part of this module

pub mod model;

use std::fmt;

use fencelock_core::{
    Acquire, Command, Config, Fence, LockName, Mode, Owner, OwnerToken, Reason, RequestId,
    SessionId, Value,
};
use proptest::prelude::*;

/// Lock names in the universe. `a` is usually a mutex, `b` a 2-slot and `c` a 3-slot
/// semaphore, so most acquires agree on the limit and contend.
pub const NAMES: [&str; 3] = ["a", "b", "c"];
/// Owner tokens are 1..=TOKENS: few, so they get reused after their grant ends.
pub const TOKENS: u128 = 8;
/// Multi-lock parts use their own tokens, one per (lock, bank): part on lock `k`
/// of bank `b` is `multi_token(k, b)`, so releases and cancels aimed at a bank's
/// request usually hit it. Two banks: two multi-lock requests can be live at once.
pub const MULTI_BANKS: u128 = 2;

pub fn multi_token(lock: usize, bank: u128) -> OwnerToken {
    tok(TOKENS + 1 + lock as u128 + NAMES.len() as u128 * bank)
}

/// Session ids are 1..=SESSIONS.
pub const SESSIONS: u128 = 2;

pub fn name(s: &str) -> LockName {
    LockName::new(s).expect("valid test name")
}

pub fn tok(t: u128) -> OwnerToken {
    OwnerToken::from_u128(t)
}

pub fn sid(s: u128) -> SessionId {
    SessionId::from_u128(s)
}

/// Every request carries `t<token>` as its owner text, so events (which carry the
/// owner, not the token) can be matched to requests.
pub fn owner_of(token: OwnerToken) -> Owner {
    Owner::new(&format!("t{}", token.as_u128())).expect("valid owner")
}

/// Bounds small enough that the generator runs into every one of them.
pub fn config_strategy() -> impl Strategy<Value = Config> {
    (
        2usize..=4,
        2usize..=5,
        3usize..=8,
        1usize..=2,
        1usize..=3,
        0usize..=6,
    )
        .prop_map(
            |(max_locks, max_waiters_per_lock, max_waiters, max_sessions, per_session, recent)| {
                Config {
                    min_ttl_ms: 5,
                    max_ttl_ms: 60,
                    max_wait_ms: 50,
                    max_lock_delay_ms: 25,
                    max_limit: 3,
                    max_locks,
                    max_waiters_per_lock,
                    max_waiters,
                    max_sessions,
                    max_locks_per_session: per_session,
                    max_recent_ends: recent,
                }
            },
        )
}

/// One step of a run: advance service time by `dt_ms`, then apply `command`.
#[derive(Clone, PartialEq, Eq)]
pub struct Step {
    pub dt_ms: u64,
    pub command: Command,
}

fn name_strategy() -> impl Strategy<Value = usize> {
    0..NAMES.len()
}

fn token_strategy() -> impl Strategy<Value = OwnerToken> {
    (1..=TOKENS).prop_map(tok)
}

/// The lock a token usually works on: t1..t4 contend for the mutex `a`, t5..t7
/// for the 2-slot `b`, t8 uses `c`. So releases, renews and cancels mostly hit
/// something, and acquires mostly contend.
pub fn home_lock(t: u128) -> usize {
    match t {
        1..=4 => 0,
        5..=7 => 1,
        _ => 2,
    }
}

/// A lock and a token: usually the token's home lock, sometimes any lock.
fn name_token_strategy() -> impl Strategy<Value = (usize, OwnerToken)> {
    prop_oneof![
        4 => (1..=TOKENS).prop_map(|t| (home_lock(t), tok(t))),
        1 => (name_strategy(), token_strategy()),
        1 => (name_strategy(), 0..MULTI_BANKS).prop_map(|(n, b)| (n, multi_token(n, b))),
    ]
}

/// A multi-lock request: 1 to 3 of the names in random order, each part's mode
/// drawn on its own, the other fields shared (so usually valid). Sometimes a
/// part breaks a rule (an election value, another wait): `InvalidArgument`.
fn acquire_all_strategy() -> impl Strategy<Value = Command> {
    let lease = prop_oneof![
        4 => (20u64..=60).prop_map(|t| (Some(t), None)),
        1 => session_strategy().prop_map(|s| (None, Some(s))),
    ];
    let wait = prop_oneof![1 => Just(0u64), 5 => 1u64..=50];
    let request_id = prop_oneof![6 => Just(None), 1 => Just(Some("m0"))];
    let broken = prop_oneof![12 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)];
    (
        Just((0..NAMES.len()).collect::<Vec<usize>>()).prop_shuffle(),
        1..=NAMES.len(),
        prop::collection::vec(
            prop_oneof![2 => Just(Mode::Exclusive), 1 => Just(Mode::Shared)],
            NAMES.len(),
        ),
        0..MULTI_BANKS,
        lease,
        wait,
        request_id,
        prop_oneof![4 => Just(0u64), 1 => 1u64..=25],
        broken,
    )
        .prop_map(
            |(
                order,
                n,
                modes,
                bank,
                (ttl_ms, session),
                wait_ms,
                request_id,
                lock_delay_ms,
                broken,
            )| {
                let names = &order[..n];
                let tokens: Vec<String> = names
                    .iter()
                    .map(|&k| multi_token(k, bank).as_u128().to_string())
                    .collect();
                let owner = Owner::new(&format!("g{}", tokens.join("."))).expect("valid owner");
                let mut parts: Vec<Acquire> = names
                    .iter()
                    .map(|&k| Acquire {
                        name: name(NAMES[k]),
                        token: multi_token(k, bank),
                        ttl_ms,
                        wait_ms,
                        owner: owner.clone(),
                        request_id: request_id.map(|r| RequestId::new(r).expect("valid")),
                        limit: k as u32 + 1,
                        lock_delay_ms,
                        session,
                        tenant: model_tenant(),
                        quota: None,
                        mode: modes[k],
                        value: None,
                    })
                    .collect();
                let last = parts.len() - 1;
                match broken {
                    1 => parts[last].value = Some(Value::new("v").expect("valid")),
                    2 => parts[last].wait_ms += 1,
                    _ => {}
                }
                Command::AcquireAll(parts)
            },
        )
}

/// Releases 1 to 3 grants at once, usually a bank's multi-lock parts.
fn release_all_strategy() -> impl Strategy<Value = Command> {
    prop_oneof![
        3 => (
            Just((0..NAMES.len()).collect::<Vec<usize>>()).prop_shuffle(),
            1..=NAMES.len(),
            0..MULTI_BANKS,
        )
            .prop_map(|(order, n, bank)| order[..n]
                .iter()
                .map(|&k| (name(NAMES[k]), multi_token(k, bank)))
                .collect::<Vec<_>>()),
        1 => prop::collection::vec(
            name_token_strategy().prop_map(|(n, t)| (name(NAMES[n]), t)),
            0..=3,
        ),
    ]
    .prop_map(|grants| Command::ReleaseAll { grants })
}

fn session_strategy() -> impl Strategy<Value = SessionId> {
    (1..=SESSIONS).prop_map(sid)
}

fn acquire_strategy() -> impl Strategy<Value = Command> {
    let lease = prop_oneof![
        13 => prop_oneof![1 => 5u64..=19, 4 => 20u64..=60].prop_map(|t| (Some(t), None)),
        5 => session_strategy().prop_map(|s| (None, Some(s))),
        // Out of range, or neither / both: InvalidArgument.
        1 => prop_oneof![
            (0u64..=4).prop_map(|t| (Some(t), None)),
            (61u64..=100).prop_map(|t| (Some(t), None)),
            Just((None, None)),
            session_strategy().prop_map(|s| (Some(10), Some(s))),
        ],
    ];
    let wait = prop_oneof![12 => Just(0u64), 37 => 1u64..=50, 1 => 51u64..=60];
    let request_id = prop_oneof![
        8 => Just(None),
        1 => Just(Some("r0")),
        1 => Just(Some("r1")),
    ];
    // Usually the lock's own limit (a=1, b=2, c=3); sometimes another one (mismatch)
    // or an invalid one (0, 4).
    let limit = prop_oneof![
        30 => Just(None),
        2 => (1u32..=3).prop_map(Some),
        1 => prop_oneof![Just(0u32), Just(4)].prop_map(Some),
    ];
    let delay = prop_oneof![16 => Just(0u64), 15 => 1u64..=25, 1 => 26u64..=30];
    // Mostly exclusive, often shared; sometimes an election campaign (with a
    // value), which is refused unless exclusive with limit 1.
    let kind = prop_oneof![
        6 => Just((Mode::Exclusive, None)),
        4 => Just((Mode::Shared, None)),
        1 => Just((Mode::Exclusive, Some("v0"))),
        1 => Just((Mode::Shared, Some("v1"))),
    ];
    (
        name_token_strategy(),
        lease,
        wait,
        request_id,
        limit,
        delay,
        kind,
    )
        .prop_map(
            |(
                (n, token),
                (ttl_ms, session),
                wait_ms,
                request_id,
                limit,
                lock_delay_ms,
                (mode, value),
            )| {
                Command::Acquire(Acquire {
                    name: name(NAMES[n]),
                    token,
                    ttl_ms,
                    wait_ms,
                    owner: owner_of(token),
                    request_id: request_id.map(|r| RequestId::new(r).expect("valid")),
                    limit: limit.unwrap_or(n as u32 + 1),
                    lock_delay_ms,
                    session,
                    tenant: model_tenant(),
                    quota: None,
                    mode,
                    value: value.map(|v| Value::new(v).expect("valid")),
                })
            },
        )
}

fn command_strategy() -> impl Strategy<Value = Command> {
    let renew_ttl = prop_oneof![
        3 => Just(None),
        2 => (5u64..=60).prop_map(Some),
        1 => (0u64..=100).prop_map(Some),
    ];
    let session_ttl = prop_oneof![5 => 10u64..=60, 1 => 0u64..=100];
    let fence = prop_oneof![Just(None), (1u64..=25).prop_map(Fence::new)];
    prop_oneof![
        14 => acquire_strategy(),
        4 => acquire_all_strategy(),
        2 => release_all_strategy(),
        3 => name_token_strategy()
            .prop_map(|(n, token)| Command::Downgrade { name: name(NAMES[n]), token }),
        2 => name_token_strategy().prop_map(|(n, token)| Command::Proclaim {
            name: name(NAMES[n]),
            token,
            value: Value::new(&format!("v{}", token.as_u128())).expect("valid"),
        }),
        4 => (name_token_strategy(), renew_ttl).prop_map(|((n, token), ttl_ms)| {
            Command::Renew { name: name(NAMES[n]), token, ttl_ms }
        }),
        5 => name_token_strategy()
            .prop_map(|(n, token)| Command::Release { name: name(NAMES[n]), token }),
        1 => (name_strategy(), fence).prop_map(|(n, fence)| Command::ForceRelease {
            name: name(NAMES[n]),
            fence,
            reason: Reason::new("test").expect("valid"),
        }),
        3 => name_token_strategy()
            .prop_map(|(n, token)| Command::CancelWait { name: name(NAMES[n]), token }),
        3 => (session_strategy(), session_ttl).prop_map(|(id, ttl_ms)| Command::OpenSession {
            id,
            ttl_ms,
            owner: Owner::new(&format!("s{}", id.as_u128())).expect("valid"),
            tenant: model_tenant(),
            quota: None,
        }),
        3 => session_strategy().prop_map(|id| Command::KeepAlive { id }),
        1 => session_strategy().prop_map(|id| Command::CloseSession { id }),
        2 => Just(Command::Tick),
        1 => Just(Command::Recover),
        1 => Just(Command::Promote),
        1 => (0u64..=40).prop_map(|floor| Command::RaiseFenceFloor { floor }),
    ]
}

/// Mostly small time steps, sometimes a jump past many deadlines at once.
fn dt_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![6 => Just(0u64), 4 => 1u64..=5, 1 => 6u64..=50]
}

pub fn steps_strategy(max_len: usize) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (dt_strategy(), command_strategy()).prop_map(|(dt_ms, command)| Step { dt_ms, command }),
        1..=max_len,
    )
}

/// Renders a command as one short line, e.g. `acquire a t3 ttl=20 wait=10 limit=1`.
pub fn render_command(c: &Command) -> String {
    let t = |t: &OwnerToken| format!("t{}", t.as_u128());
    match c {
        Command::Acquire(a) => {
            let mut s = format!("acquire {} {}", a.name, t(&a.token));
            if let Some(ttl) = a.ttl_ms {
                s += &format!(" ttl={ttl}");
            }
            if let Some(id) = a.session {
                s += &format!(" session=s{}", id.as_u128());
            }
            s += &format!(" wait={} limit={}", a.wait_ms, a.limit);
            if a.lock_delay_ms > 0 {
                s += &format!(" delay={}", a.lock_delay_ms);
            }
            if let Some(r) = &a.request_id {
                s += &format!(" rid={}", r.as_str());
            }
            if a.mode == Mode::Shared {
                s += " shared";
            }
            if let Some(v) = &a.value {
                s += &format!(" value={}", v.as_str());
            }
            s
        }
        Command::AcquireAll(parts) => {
            let parts: Vec<String> = parts
                .iter()
                .map(|a| render_command(&Command::Acquire(a.clone())))
                .collect();
            format!("all[{}]", parts.join("; "))
        }
        Command::Downgrade { name, token } => format!("downgrade {name} {}", t(token)),
        Command::Proclaim { name, token, value } => {
            format!("proclaim {name} {} {}", t(token), value.as_str())
        }
        Command::ReleaseAll { grants } => {
            let grants: Vec<String> = grants
                .iter()
                .map(|(n, tk)| format!("{n} {}", t(tk)))
                .collect();
            format!("release-all [{}]", grants.join(", "))
        }
        Command::Renew {
            name,
            token,
            ttl_ms,
        } => match ttl_ms {
            Some(ttl) => format!("renew {name} {} ttl={ttl}", t(token)),
            None => format!("renew {name} {}", t(token)),
        },
        Command::Release { name, token } => format!("release {name} {}", t(token)),
        Command::ForceRelease { name, fence, .. } => match fence {
            Some(f) => format!("force-release {name} fence={f}"),
            None => format!("force-release {name}"),
        },
        Command::CancelWait { name, token } => format!("cancel-wait {name} {}", t(token)),
        Command::OpenSession { id, ttl_ms, .. } => {
            format!("open-session s{} ttl={ttl_ms}", id.as_u128())
        }
        Command::KeepAlive { id } => format!("keepalive s{}", id.as_u128()),
        Command::CloseSession { id } => format!("close-session s{}", id.as_u128()),
        Command::Tick => "tick".into(),
        Command::Recover => "recover".into(),
        Command::Promote => "promote".into(),
        Command::RaiseFenceFloor { floor } => format!("raise-fence-floor {floor}"),
    }
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{}ms {}", self.dt_ms, render_command(&self.command))
    }
}

/// The one principal of the generated commands: its usage is counted (and checked
/// after every command) without a quota or an ownership check changing any answer.
pub fn model_tenant() -> Option<fencelock_core::Tenant> {
    Some(fencelock_core::Tenant::new("m").expect("a valid principal"))
}
