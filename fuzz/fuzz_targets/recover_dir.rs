//! Fuzz target `recover_dir`: see `fencelock_fuzz::disk::recover_dir`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::disk::recover_dir(data));
