//! The integration tests of this crate, one module per file, linked into one test
//! binary: one link and one copy of the shared test support instead of one per file.
//! Run one file's tests with `cargo nextest run -p fencelock-fence -E 'test(/^<file>::/)'`
//! or `cargo test -p fencelock-fence --test it <file>::`.

mod support;

mod file;
mod http;
mod memory;
mod paused_holder;
mod postgres;
