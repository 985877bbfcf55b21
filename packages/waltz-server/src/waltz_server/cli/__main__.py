from waltz_server.cli import main

main()
