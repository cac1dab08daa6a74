//! `rfab_read_lat`: RDMA read latency through rverbs' `fi_read`, printed as perftest's `ib_read_lat` does.

mod common;

fn main() -> std::process::ExitCode {
    common::main(common::Test::ReadLat)
}
