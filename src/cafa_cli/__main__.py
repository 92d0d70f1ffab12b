from cafa_cli.cli import main

main()
