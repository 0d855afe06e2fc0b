//! The conformance suite on libfabric (tcp;ofi_rxm).

kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::FabricTcp);
