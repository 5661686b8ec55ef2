//! Fuzz target `audit_records`: see `fencelock_fuzz::disk::audit_records`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::disk::audit_records(data));
