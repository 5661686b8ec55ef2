//! The integration tests of this crate, one module per file, linked into one test
//! binary: one link and one copy of the shared test support instead of one per file.
//! Run one file's tests with `cargo nextest run -p fencelock-cli -E 'test(/^<file>::/)'`
//! or `cargo test -p fencelock-cli --test it <file>::`.

mod attack;
mod support;

mod attacks_browser;
mod attacks_connections;
mod attacks_datadir;
mod attacks_streams;
mod attacks_tenants;
mod audit_cli;
mod cli_shapes;
mod clients;
mod cluster_client;
mod corrupt_data;
mod durability;
mod elect;
mod leader_watch;
mod load_limits;
mod run;
mod run_terminal;
mod security;
mod watch_resume;
