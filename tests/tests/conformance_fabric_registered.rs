//! The conformance suite on libfabric (tcp;ofi_rxm, registering every buffer).

kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::FabricRegistered);
