// Command memqos-leak is a local CRI client that leaks connections the way critest 1.26 does.
//
// critest's framework makes a runtime service client and an image service client for every spec
// (framework.LoadCRIClient, two connections) and never closes them. This program does the same
// with the same client package (k8s.io/kubernetes/pkg/kubelet/cri/remote, vendored in cri-tools
// v1.26.x) for -specs "specs", each of which calls Version and Status (the calls of critest's
// "Runtime info" specs) and ImageFsInfo on its own clients. It prints how many passed, keeps
// every connection open for -hold, and exits 1 when one failed.
//
// It builds only inside a cri-tools v1.26.x tree, whose vendor/ holds every dependency:
// scripts/critest-host adds it there with `go build -overlay` (the tree is not changed).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"k8s.io/kubernetes/pkg/kubelet/cri/remote"
)

func main() {
	endpoint := flag.String("endpoint", "", "the CRI endpoint, unix:///path")
	specs := flag.Int("specs", 80, "how many specs to run")
	hold := flag.Duration("hold", 0, "how long to keep every connection open after the last spec")
	flag.Parse()
	passed := 0
	var clients []interface{} // never closed
	for i := 1; i <= *specs; i++ {
		err := func() error {
			runtime, err := remote.NewRemoteRuntimeService(*endpoint, 10*time.Second, nil)
			if err != nil {
				return err
			}
			clients = append(clients, runtime)
			images, err := remote.NewRemoteImageService(*endpoint, 10*time.Second, nil)
			if err != nil {
				return err
			}
			clients = append(clients, images)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := runtime.Version(ctx, "v1"); err != nil {
				return err
			}
			if _, err := runtime.Status(ctx, false); err != nil {
				return err
			}
			_, err = images.ImageFsInfo(ctx)
			return err
		}()
		if err != nil {
			fmt.Printf("spec %d: FAIL: %v\n", i, err)
		} else {
			passed++
		}
	}
	fmt.Printf("memqos-leak: %d/%d specs passed, %d clients kept open\n", passed, *specs, len(clients))
	time.Sleep(*hold)
	if passed != *specs {
		os.Exit(1)
	}
}
