from lenext.export import main

main()
