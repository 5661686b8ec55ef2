//! Seed inputs for every fuzz target: hand-written, valid encodings made with the
//! real encoders, and a few known-bad ones. `tests/seeds.rs` runs them on stable;
//! `FENCELOCK_FUZZ_WRITE_SEEDS=1 cargo test -p fencelock-fuzz --test it seeds::` writes
//! them to `fuzz/seeds/<target>/` for `scripts/fuzz.sh` to start from.
#![allow(dead_code)]

use fencelock_core::{Acquire, Command, Config, Core, LockName, Owner, OwnerToken, Reason};
use fencelock_proto as pb;
use fencelock_server::codec::{encode_record, encode_snapshot, RecordMeta};
use prost::Message;

/// A fuzz harness.
pub type Harness = fn(&[u8]);

/// Every target's name and its harness.
pub const TARGETS: [(&str, Harness); 10] = [
    ("http", fencelock_fuzz::api::http),
    ("grpc", fencelock_fuzz::api::grpc),
    ("wire", fencelock_fuzz::api::wire),
    ("config", fencelock_fuzz::config::config_file),
    ("log_record", fencelock_fuzz::codec::log_record),
    ("snapshot", fencelock_fuzz::codec::snapshot),
    ("log_dir", fencelock_fuzz::disk::log_dir),
    ("recover_dir", fencelock_fuzz::disk::recover_dir),
    ("audit_records", fencelock_fuzz::disk::audit_records),
    ("core_commands", fencelock_fuzz::core_seq::core_commands),
];

fn with(first: u8, rest: &[u8]) -> Vec<u8> {
    let mut v = vec![first];
    v.extend_from_slice(rest);
    v
}

fn name(s: &str) -> LockName {
    LockName::new(s).unwrap()
}

/// Commands of every kind, for records and snapshots.
pub fn commands() -> Vec<Command> {
    vec![
        Command::Acquire(Acquire {
            name: name("a"),
            token: OwnerToken::from_u128(1),
            ttl_ms: Some(1_000),
            wait_ms: 0,
            owner: Owner::new("w1").unwrap(),
            request_id: None,
            limit: 1,
            lock_delay_ms: 5,
            session: None,
            tenant: Some(fencelock_core::Tenant::new("w").unwrap()),
            quota: Some(fencelock_core::Quota {
                max_sessions: 1,
                max_held_locks: 2,
                max_waiters: 1,
            }),
            mode: Default::default(),
            value: None,
        }),
        Command::Acquire(Acquire {
            name: name("b"),
            token: OwnerToken::from_u128(2),
            ttl_ms: Some(1_000),
            wait_ms: 0,
            owner: Owner::new("w2").unwrap(),
            request_id: None,
            limit: 1,
            lock_delay_ms: 0,
            session: None,
            tenant: None,
            quota: None,
            mode: Default::default(),
            value: None,
        }),
        Command::Renew {
            name: name("a"),
            token: OwnerToken::from_u128(1),
            ttl_ms: Some(2_000),
        },
        Command::ForceRelease {
            name: name("a"),
            fence: None,
            reason: Reason::new("stuck").unwrap(),
        },
        Command::Release {
            name: name("b"),
            token: OwnerToken::from_u128(2),
        },
        Command::Tick,
        Command::Recover,
        Command::RaiseFenceFloor { floor: 10 },
    ]
}

pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "http" => vec![
            with(0, br#"{"name":"inventory:item:1","ttl_ms":1000}"#),
            with(0, br#"{"name":"sem","ttl_ms":1000,"limit":1,"lock_delay_ms":5}"#),
            with(0, br#"{"name":"a","ttl_ms":1000,"wait_ms":10,"owner":"w","request_id":"r1"}"#),
            with(0, br#"{"name":"a","ttl_ms":1000,"session":"00000000000000000000000000000001"}"#),
            with(1, br#"{"name":"a","owner_token":"00000000000000000000000000000001","ttl_ms":100}"#),
            with(2, br#"{"name":"a","owner_token":"00000000000000000000000000000001"}"#),
            with(3, br#"{"name":"a","fence":1,"reason":"stuck"}"#),
            with(4, br#"{"ttl_ms":1000,"owner":"s"}"#),
            with(5, b"00000000000000000000000000000001"),
            with(6, b"prefix=a&limit=5"),
            with(6, b"limit=0"),
            with(7, b"inventory:item:1"),
            with(7, b"%ff%00"),
            with(0, b"{"),
            with(0, br#"{"name":"","ttl_ms":0}"#),
            with(0, br#"{"name":"a\u0001","ttl_ms":18446744073709551615}"#),
            with(0, br#"{"name":"a","ttl_ms":1000,"limit":4294967295}"#),
            with(0, br#"{"name":"a","ttl_ms":1000,"extra":1}"#),
        ],
        "wire" => {
            use pb::wire::{encode_request, Hello, Request};
            let frames = |requests: &[(u64, Request)]| {
                let mut out = Vec::new();
                for (id, request) in requests {
                    encode_request(&mut out, *id, request);
                }
                out
            };
            let acquire = |name: &str, limit: u32, wait_ms: u64| {
                Request::Acquire(pb::AcquireRequest {
                    name: name.into(),
                    ttl_ms: Some(1_000),
                    wait_ms,
                    limit,
                    ..Default::default()
                })
            };
            let token = "00000000000000000000000000000001".to_owned();
            let mut oversized = frames(&[(1, Request::Ping)]);
            oversized[..4].copy_from_slice(&u32::MAX.to_le_bytes());
            vec![
                frames(&[(1, acquire("w", 1, 0)), (2, Request::Ping)]),
                frames(&[
                    (1, acquire("w", 1, 0)),
                    (2, acquire("w", 1, 10)),
                    (2, Request::Cancel),
                ]),
                frames(&[
                    (
                        1,
                        Request::Renew(pb::RenewRequest {
                            name: "w".into(),
                            owner_token: token.clone(),
                            ttl_ms: Some(100),
                        }),
                    ),
                    (
                        2,
                        Request::Release(pb::ReleaseRequest {
                            name: "w".into(),
                            owner_token: token,
                        }),
                    ),
                ]),
                frames(&[(7, Request::Hello(Hello { token: "t".into() }))]),
                frames(&[(1, acquire("", 0, 0))]),
                oversized,
                vec![13, 0, 0, 0, 0x42, 1, 0, 0, 0, 0, 0, 0, 0, 0xff],
            ]
        }
        "grpc" => {
            let acquire = pb::AcquireRequest {
                name: "sem".into(),
                ttl_ms: Some(1_000),
                limit: 1,
                ..Default::default()
            };
            let renew = pb::RenewRequest {
                name: "a".into(),
                owner_token: "00000000000000000000000000000001".into(),
                ttl_ms: Some(100),
            };
            let release = pb::ReleaseRequest {
                name: "a".into(),
                owner_token: "00000000000000000000000000000001".into(),
            };
            let open = pb::OpenSessionRequest {
                ttl_ms: 1_000,
                ..Default::default()
            };
            let list = pb::ListLocksRequest {
                prefix: "a".into(),
                ..Default::default()
            };
            vec![
                with(0, &acquire.encode_to_vec()),
                with(1, &renew.encode_to_vec()),
                with(2, &release.encode_to_vec()),
                with(5, &list.encode_to_vec()),
                with(6, &open.encode_to_vec()),
                with(9, &pb::WatchRequest::default().encode_to_vec()),
                with(0, &[0xff, 0xff, 0xff]),
                with(0x80, &[0, 0, 0, 0, 9, 1]),
                with(0x80, &[1, 0, 0, 0, 0]),
            ]
        }
        "config" => vec![
            std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/fencelock.toml"))
                .expect("the example config"),
            b"listen = \"127.0.0.1:9000\"\nlog_level = \"info\"\n[limits]\nmax_locks = 7\n".to_vec(),
            b"[storage]\nsegment_bytes = 1048576\n[audit]\nmax_age_hours = 1\n".to_vec(),
            b"[[auth.tokens]]\nname = \"ops\"\nrole = \"admin\"\nprefixes = [\"\"]\nsha256 = \"0000000000000000000000000000000000000000000000000000000000000000\"\n".to_vec(),
            b"[limits]\nmin_ttl_ms = 0\n".to_vec(),
            b"unknown = 1\n".to_vec(),
        ],
        "log_record" => commands()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let meta = RecordMeta {
                    seq: i as u64 + 1,
                    now_ms: 10 * i as u64,
                    wall_ms: 1_700_000_000_000,
                    actor: (i % 2 == 1).then(|| "ops".to_owned()),
                };
                encode_record(&meta, c)
            })
            .collect(),
        "snapshot" => {
            let mut core = Core::new(Config::default());
            let mut out = vec![encode_snapshot(&core.export())];
            for (i, c) in commands().into_iter().take(2).enumerate() {
                let _ = core.apply(i as u64, c);
                out.push(encode_snapshot(&core.export()));
            }
            out
        }
        // Appends (0..=3), syncs (4), snapshots (6), stop (7), then damage.
        "log_dir" => vec![
            vec![0, 0, 3, b'a', b'b', b'c', 0, 1, b'x', 4, 0, 2, b'y', b'z', 4, 7],
            vec![9, 0, 5, 1, 2, 3, 4, 5, 4, 6, 2, 9, 9, 0, 1, 7, 4, 7],
            vec![200, 0, 8, 1, 1, 1, 1, 1, 1, 1, 1, 4, 0, 8, 2, 2, 2, 2, 2, 2, 2, 2, 4, 7],
        ],
        "recover_dir" => vec![vec![1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0], vec![2, 0, 4, 1, 0, 0, 0, 0, 1, 0, 1, 5, 0]],
        "audit_records" => vec![audit_seed(), vec![1, 4, b'F', b'L', b'A', b'U', 2, 1, 2]],
        "core_commands" => vec![
            vec![0x55, 0, 0, 0, 1, 20, 0, 0, 0, 1, 0, 0, 0, 1, 1, 20, 1, 0, 200, 0xff, 0, 5, 0, 0],
            vec![0xff; 64],
            (0u8..=255).collect(),
        ],
        other => panic!("no seeds for {other}"),
    }
}

/// A valid audit log: records written by `AuditStore::append`, re-read with the log
/// and laid out as the `audit_records` harness reads its input.
fn audit_seed() -> Vec<u8> {
    use fencelock_server::audit::{AuditConfig, AuditEntry, AuditKind, AuditStore};
    let dir = tempfile::tempdir().unwrap();
    {
        let mut store = AuditStore::open(dir.path(), AuditConfig::default(), false).unwrap();
        let entry = |seq: u64, kind| AuditEntry {
            seq,
            index: 0,
            wall_ms: 1_700_000_000_000,
            kind,
            lock: Some("a".into()),
            fence: Some(seq),
            owner: Some("w".into()),
            session: None,
            request_id: None,
            actor: None,
            reason: None,
            duration_ms: 3,
            detail: None,
        };
        store.append(vec![entry(1, AuditKind::Grant)]).unwrap();
        store
            .append(vec![entry(2, AuditKind::Grant), entry(3, AuditKind::Grant)])
            .unwrap();
        store.sync().unwrap();
    }
    let (_, recovered) = fencelock_log::Log::open(dir.path(), Default::default()).unwrap();
    // No snapshot; one byte of count; then each record as [len][bytes].
    let mut input = vec![0u8, recovered.records.len() as u8];
    for r in &recovered.records {
        assert!(r.len() <= 255, "seed record too long for the harness");
        input.push(r.len() as u8);
        input.extend_from_slice(r);
    }
    input
}
