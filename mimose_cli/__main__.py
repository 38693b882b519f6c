from mimose_cli.entry import main

main()
