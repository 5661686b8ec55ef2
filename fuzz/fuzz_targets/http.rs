//! Fuzz target `http`: see `fencelock_fuzz::api::http`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::api::http(data));
