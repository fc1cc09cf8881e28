from lightning_ddpx.bench.cli import main

main()
