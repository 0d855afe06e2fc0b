//! The conformance suite on libfabric (tcp;ofi_rxm, registering every buffer).

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::FabricRegistered);
