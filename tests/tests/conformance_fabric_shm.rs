//! The conformance suite on libfabric (shm).

kungfu_transport::conformance_tests!(kungfu_transport::conformance::clusters::FabricShm);
