from waltz_cli.app import main

main()
