//! Fuzz target `config`: see `fencelock_fuzz::config::config_file`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::config::config_file(data));
