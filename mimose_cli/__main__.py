from mimose_cli.cli import main

main()
