from disttrace.cli import main

main()
