module fencelock.example/lockclient

go 1.19
