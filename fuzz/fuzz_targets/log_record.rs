//! Fuzz target `log_record`: see `fencelock_fuzz::codec::log_record`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::codec::log_record(data));
