//! Benchmarks of KungFu-rs live in `benches/` (criterion). This crate has no
//! library code of its own.
