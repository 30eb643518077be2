//! The `ascend-moe` command-line tool: `info`, `check`, `bench`.

fn main() {
    eprintln!("ascend-moe: no commands yet");
    std::process::exit(2);
}
