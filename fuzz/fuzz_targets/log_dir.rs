//! Fuzz target `log_dir`: see `fencelock_fuzz::disk::log_dir`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::disk::log_dir(data));
