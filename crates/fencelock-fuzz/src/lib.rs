//! Fuzz harnesses for every decoder of fencelock: one function per target, each
//! taking arbitrary bytes. The cargo-fuzz targets in `/fuzz` call them (nightly,
//! libFuzzer), and `tests/seeds.rs` feeds them seed and proptest-generated inputs on
//! stable, so `cargo test --workspace` runs the same harness code.
//!
//! The contract every harness checks: bad input is an ordinary `Err` (or a 4xx /
//! a gRPC client-error status), never a panic, a 500, an INTERNAL status or a
//! stopped engine; every input is capped in size ([`MAX_INPUT_BYTES`]) so nothing
//! can allocate without bound. A harness panics only when that contract (or an
//! invariant of the state it drives) is broken — which is what the fuzzer reports.
//!
//! Targets: [`api::http`] and [`api::grpc`] (request bodies through the real router
//! and engine), [`api::wire`] (frames of the `flw/1` wire protocol through a real
//! wire connection and engine), [`config::config_file`] (the CLI's TOML config, parsed and resolved),
//! [`codec::log_record`], [`codec::snapshot`] (decode and import),
//! [`disk::log_dir`] (a real log written, damaged, then recovered with an oracle),
//! [`disk::recover_dir`] (whole-directory recovery from arbitrary files),
//! [`disk::audit_records`] (the audit store's records), and
//! [`core_seq::core_commands`] (random command sequences into the core).
//!
//! **Planted bugs.** With the environment variable `FENCELOCK_FUZZ_PLANT` set to a
//! target's name, that harness panics as soon as it sees an input that gets *through*
//! its decoder to a deep, accepted state (for example a record that decodes as a
//! forced release with a fence): a stand-in for a bug on a rarely reached path.
//! `scripts/fuzz.sh --planted` checks that the fuzzer finds each one in CI time.
#![deny(missing_docs)]

pub mod api;
pub mod codec;
pub mod config;
pub mod core_seq;
pub mod disk;
mod input;

pub use input::Input;

/// Inputs longer than this are ignored by every harness (the fuzz targets also pass
/// `-max_len`), so no input can make a decoder allocate without bound.
pub const MAX_INPUT_BYTES: usize = 64 << 10;

/// Whether the planted bug of `target` is switched on (see the crate docs).
pub fn planted(target: &str) -> bool {
    static PLANT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    PLANT
        .get_or_init(|| std::env::var("FENCELOCK_FUZZ_PLANT").ok())
        .as_deref()
        .is_some_and(|p| p == target || p == "all")
}

/// Panics with a recognisable message if the planted bug of `target` is on.
pub(crate) fn plant(target: &str, what: &str) {
    if planted(target) {
        panic!("planted bug reached in {target}: {what}");
    }
}
