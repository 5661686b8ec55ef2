//! Fuzz target `snapshot`: see `fencelock_fuzz::codec::snapshot`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::codec::snapshot(data));
