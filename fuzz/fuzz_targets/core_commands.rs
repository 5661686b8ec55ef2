//! Fuzz target `core_commands`: see `fencelock_fuzz::core_seq::core_commands`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::core_seq::core_commands(data));
