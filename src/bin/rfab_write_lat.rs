//! `rfab_write_lat`: RDMA write ping-pong latency through rverbs' `fi_write`, printed as
//! perftest's `ib_write_lat` does.

mod common;

fn main() -> std::process::ExitCode {
    common::main(common::Test::WriteLat)
}
