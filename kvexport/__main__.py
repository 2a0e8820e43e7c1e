from kvexport.cli import main

main()
