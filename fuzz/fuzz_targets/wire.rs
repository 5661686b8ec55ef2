//! Fuzz target `wire`: see `fencelock_fuzz::api::wire`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::api::wire(data));
