//! Fuzz target `grpc`: see `fencelock_fuzz::api::grpc`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencelock_fuzz::api::grpc(data));
