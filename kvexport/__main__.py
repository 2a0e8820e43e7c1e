from kvexport.commands.cli import main

main()
