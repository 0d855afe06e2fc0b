//! Tests of the verbs wire. Without a device: the protocol's pure parts
//! (`proto`), the core over the fake fabric (`core`), whole endpoints over
//! the fake with the real bootstrap and the error without a device
//! (`wire`); the conformance suite over the fake is kungfu-tests'
//! `conformance_verbs` (`--features verbs`). With `KUNGFU_TEST_IB_DEVICE`
//! naming a device (e.g. SoftRoCE's `rxe0`), the same endpoint exchange
//! over it (`wire`); without, that test prints a note and passes.

mod core;
mod proto;
mod wire;
