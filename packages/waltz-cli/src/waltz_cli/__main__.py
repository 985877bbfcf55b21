from waltz_cli import main

main()
