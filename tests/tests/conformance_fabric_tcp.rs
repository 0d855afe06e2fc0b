//! The conformance suite on libfabric (tcp;ofi_rxm).

kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::FabricTcp);
