//! The integration tests of this crate, one module per file, linked into one test
//! binary: one link and one copy of the shared test support instead of one per file.
//! Run one file's tests with `cargo nextest run -p fencelock-sim -E 'test(/^<file>::/)'`
//! or `cargo test -p fencelock-sim --test it <file>::`.

#[path = "../../fencelock-core/tests/common/mod.rs"]
mod common;

mod kinds;
mod model_planted;
mod planted;
mod seeds;
mod tidy;
