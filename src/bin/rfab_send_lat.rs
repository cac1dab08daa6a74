//! `rfab_send_lat`: send/recv ping-pong latency through rverbs, printed as perftest does.

mod common;

fn main() -> std::process::ExitCode {
    common::main(common::Test::SendLat)
}
