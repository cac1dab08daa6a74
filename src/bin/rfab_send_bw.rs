//! `rfab_send_bw`: send/recv bandwidth through rverbs, printed as perftest does.

mod common;

fn main() -> std::process::ExitCode {
    common::main(common::Test::SendBw)
}
