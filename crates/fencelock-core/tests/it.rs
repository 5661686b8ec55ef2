//! The integration tests of this crate, one module per file, linked into one test
//! binary: one link and one copy of the shared test support instead of one per file.
//! Run one file's tests with `cargo nextest run -p fencelock-core -E 'test(/^<file>::/)'`
//! or `cargo test -p fencelock-core --test it <file>::`.

mod common;

mod kinds;
mod model;
mod replay;
mod scenarios;
mod tenants;
mod tidy;
