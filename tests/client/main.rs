//! The client retry layer (`client` feature): against a fake upstream, the shop behind a lossy
//! proxy, and the gRPC shop under a real tonic client.

#[cfg(feature = "client")]
mod client;
#[cfg(feature = "client")]
mod client_grpc;
