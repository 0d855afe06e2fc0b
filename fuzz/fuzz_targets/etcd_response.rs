#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kungfu::fuzzing::etcd_response(data));
