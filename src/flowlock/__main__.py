from flowlock.cli import main

main()
