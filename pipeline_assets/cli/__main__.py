from pipeline_assets.cli.root import main

main()
